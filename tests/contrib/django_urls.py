"""The test site's views (they count how often they really ran) and URLs."""

from __future__ import annotations

from django.http import HttpResponse
from django.urls import path
from django.views.decorators.cache import cache_page
from django.views.decorators.vary import vary_on_headers

CALLS = {"page": 0, "vary": 0, "site": 0}


@cache_page(30)
def page(request):
    CALLS["page"] += 1
    return HttpResponse(f"page {CALLS['page']}")


@cache_page(30)
@vary_on_headers("X-Tenant")
def vary(request):
    CALLS["vary"] += 1
    return HttpResponse(f"{request.headers.get('X-Tenant', '-')} {CALLS['vary']}")


def site(request):          # cached by the per-site middleware alone
    CALLS["site"] += 1
    return HttpResponse(f"site {CALLS['site']}")


urlpatterns = [path("page/", page), path("vary/", vary), path("site/", site)]
