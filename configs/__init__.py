"""Bundled configurations (TOML), validated by mleagle.engine.contract.config."""
