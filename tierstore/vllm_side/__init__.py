"""Scripts kvscope runs with the vLLM virtualenv's Python (which does not have kvscope): they import only vLLM's own
dependencies and the standard library."""
