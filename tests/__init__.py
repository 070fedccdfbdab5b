"""The test suite: a package, so test files import their helpers as `tests.helpers` (one way)."""
