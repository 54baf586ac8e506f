"""The control plane: FastAPI routers (thin) → services (logic) → store (SQL).

`create_app(settings)` builds the app; `serve(settings)` runs it under uvicorn.
"""

from computepool.server.app import create_app
from computepool.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
