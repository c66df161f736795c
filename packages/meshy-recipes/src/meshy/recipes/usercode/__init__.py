"""The user's task code: importing it (imports), trying it before a run (task_trial), its errors in a run
(task_errors) and the held-out problems it is evaluated on (held_out)."""
