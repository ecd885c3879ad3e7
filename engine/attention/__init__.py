"""Attention backends: the interface GPU backends implement, and the torch reference backend."""
