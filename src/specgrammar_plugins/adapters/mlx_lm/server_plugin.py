"""The specgrammar plugin for ``mlx_lm.server --plugin specgrammar`` (entry point group ``mlx_lm.server_plugins``)."""
