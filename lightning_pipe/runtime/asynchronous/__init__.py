"""Weights across steps for the asynchronous schedules: PipeDream's stashed versions, PipeMare's and XPipe's
prediction."""
