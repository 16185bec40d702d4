"""What every public function and backend shares: the call types, the
input checks, the target platform, one registry of backends and one
dispatcher for attention and decode."""
