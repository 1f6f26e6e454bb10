"""Process helpers for every room: leaving a process, telling processes apart, trimming
imports."""
