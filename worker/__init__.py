"""What runs on every proc for the tensor engine (instruction interpreter, ref table, collectives).

Not built yet: see the tensor-engine issue.
"""
