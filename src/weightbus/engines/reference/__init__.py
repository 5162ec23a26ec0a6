"""The reference engine (`weightbus serve`): ranks (`engine/`), models and TP layers (`models/`,
`layers/`) and the HTTP control plane (`server/`). docs/engine.md walks a request through it."""
