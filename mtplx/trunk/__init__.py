"""The target model: the only contact with mlx-lm internals (compat), the trunk wrapper, cache rollback, the prompt cache."""
