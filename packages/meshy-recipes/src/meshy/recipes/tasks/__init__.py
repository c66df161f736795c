"""Tasks a recipe can name: a tokenizer, a prompt source and a reward function, all built locally."""
