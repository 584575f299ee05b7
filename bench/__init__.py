"""The benchmark: round speeds and idle time against N, with baselines, real or emulated."""
