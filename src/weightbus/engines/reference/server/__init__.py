"""The engine's HTTP side: API schemas, FastAPI app, process launcher, `serve` command."""
