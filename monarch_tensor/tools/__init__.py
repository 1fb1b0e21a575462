"""Developer tools; ``monarch_tensor.tools.config`` holds ``Workspace`` (Monarch's ``monarch.tools.config``)."""
