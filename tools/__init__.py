"""Generators of docs from the code and its records (docs/config.md, the README's demo block)."""
