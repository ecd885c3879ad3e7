"""Bundled configurations (TOML), validated by mleagle.engine.config."""
