"""The package version (shared by the client, the daemon and checkpoints' logs)."""

__version__ = "0.1.0"
