"""The watchers of a gang: start, poll, fail-fast cancel, setup, hangs, retries, replacement, results."""
