"""Example scenarios (kvscope.examples): no code. `long_output.yaml` ships with the package for `kvscope demo`; a
regular package, not a namespace one, so that an editable install finds it too (its folder is not under kvscope/)."""
