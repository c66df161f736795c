"""What tasks and agents both speak: a problem (problem) and the chat templates that render conversations."""
