"""/docs must work without internet: every URL the Swagger UI page loads is served by the service itself."""

import re

import pytest
from conftest import make_settings, running_service

pytestmark = pytest.mark.anyio


async def test_docs_page_loads_only_local_assets_and_they_are_served(models_dir):
    async with running_service(make_settings(models_dir)) as client:
        page = await client.get("/docs")
        assert page.status_code == 200
        urls = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", page.text)
        assert any(u.endswith("swagger-ui-bundle.js") for u in urls) and any(u.endswith(".css") for u in urls)
        external = [u for u in urls if re.match(r"^(https?:)?//", u)]
        assert external == [], f"/docs loads from the internet: {external}"
        for url in urls:
            response = await client.get(url)
            assert response.status_code == 200, url
            assert response.content, url
        assert (await client.get("/redoc")).status_code == 404  # no CDN-only page left behind
