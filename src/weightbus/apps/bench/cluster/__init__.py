"""`weightbus bench cluster`: pushes across hosts whose links, not the cores, are the bound."""
