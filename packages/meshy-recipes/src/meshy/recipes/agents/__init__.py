"""Multi-turn, tool-using trajectories: tool calls parsed from the policy's text, tools run with limits."""
