"""Looking at a run: `meshy inspect` (inspect_run), `meshy sample`, its curves (progress) and metric sinks."""
