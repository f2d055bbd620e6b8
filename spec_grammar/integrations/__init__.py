"""Integrations of spec-grammar into serving engines (each subpackage imports its engine)."""
