"""Starting a run: `meshy run` (run), torchrun's entry on every rank (`python -m meshy.recipes.launch`,
then rank), the data-plane servers, nodes, clusters and shared directories, and what watches a run."""
