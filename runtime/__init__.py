"""precast's runtime. The Python API for apps is runtime/api.py; its names are re-exported here
lazily (`from precast.runtime import open_bundle`), so importing any runtime module, the `precast`
command's included, does not load the API."""

_API = ("open_bundle", "Bundle", "Report", "ComponentPlan", "Option", "PassedOver", "Component", "Pipeline",
        "Image", "Cancelled", "UserError")


def __getattr__(name: str):
    if name in _API:
        from . import api
        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
