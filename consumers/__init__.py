"""FastStream services, one module each. They never import each other; they share `flywheel`."""
