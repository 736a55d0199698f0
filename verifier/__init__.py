"""kvscope.verifier: recorded counters in DuckDB, machine criteria compiled to SQL, evidence an auditor re-runs."""
