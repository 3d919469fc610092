"""An upload view: the photo's job is submitted in the view's transaction."""

from __future__ import annotations

from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

import reactor


@csrf_exempt
def upload(request: HttpRequest) -> JsonResponse:
    photo_id = request.POST["photo_id"]
    with transaction.atomic():  # the photo's own rows would be saved here too
        reactor.submit(connection, photo_id)
    return JsonResponse({"photo_id": photo_id}, status=201)
