"""Research harnesses: oracle selections, key temperature (not kvrag features)."""
