"""Integrations with engines weightbus does not own (a vLLM weight-transfer backend is next).

Each integration is one module or subpackage here plus one registry line (an engine target in
`weightbus.publisher.targets`, a transport in `weightbus.transport`). Integrations import the
core only (plan, wire, digest, transport, receiver, publisher), never the reference engine;
`make test` checks it (import-linter contracts in pyproject.toml).
"""
