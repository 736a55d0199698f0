"""kvscope.api: the service: live A/B tests on the embedded store, collapse alerts, evidence REST, a built-in page."""
