"""Where components run: `local` (one process, the default, no Ray) or `ray` (`RayRuntime`).

Importing this package does not import Ray; `molt.runtime.backend` does.
"""
