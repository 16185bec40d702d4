"""Examples for jflash (run from the repository root, e.g. ``make demo``)."""
