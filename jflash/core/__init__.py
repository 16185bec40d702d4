"""What every backend shares: the call types, the target platform, one
registry of backends and one dispatcher for attention and decode."""
