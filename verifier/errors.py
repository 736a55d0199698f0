"""The verifier's errors: each names the file, run, criterion or field that was wrong (the CLI exits 2 on them)."""


class VerifierError(ValueError):
    """Bad input to the verifier (unknown run, duplicate run, empty series...): the message names what."""


class SchemaError(VerifierError):
    """The database cannot be used by this kvscope (too new, or not a kvscope database)."""
