"""Helpers the test folders share (plain code; the fixtures are in tests/conftest.py).

The test folders are not packages, so pytest's default import mode (prepend) puts tests/, the folder of
tests/conftest.py, on sys.path before it imports any test module: every test imports these as `support.<module>`.
"""
