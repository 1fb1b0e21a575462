"""What runs on every proc for the tensor engine: the instruction interpreter, refs, streams, collectives."""
