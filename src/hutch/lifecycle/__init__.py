"""The lifecycle engine: states, pause/suspend/resume, idleness, time limits."""
