"""`mtplx forge`: train an MTP head for a model that ships none, on its own generations (a command; the engine never imports it)."""
