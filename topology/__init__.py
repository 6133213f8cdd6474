"""Machine topology (GPUs, switches, NICs); thin until the topology issue."""
