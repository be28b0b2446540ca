"""Where components run: `local` (`LocalRuntime`: one process, the default, no Ray) or `ray` (`RayRuntime`), behind
the `Runtime` interface of `molt/runtime/base.py`; engines of either come from `molt/runtime/factory.py`.

Importing this package does not import Ray; `molt.runtime.backend` does."""
