"""Tests of the photos app: the view submits, the handler runs, a failure is retried."""

from django.db import connection
from django.test import TestCase

import reactor
from reactor import testing

HANDLERS = {"photo.process": "photos.handlers.process"}


class PhotoJobsTest(TestCase):  # each test in a transaction: the kit sees its rows
    def test_upload_submits_the_photo(self) -> None:
        response = self.client.post("/upload/", {"photo_id": "IMG_1"})
        self.assertEqual(response.status_code, 201)
        testing.assert_submitted(connection, "IMG_1", state="pending", attempts=0)

    def test_the_handler_runs(self) -> None:
        reactor.submit(connection, "IMG_2")
        reactor.submit(connection, "not-a-photo")
        results = testing.run_jobs(connection, handlers=HANDLERS)
        outcomes = {r.photo_id: (r.outcome, r.error) for r in results}
        self.assertEqual(outcomes["IMG_2"], ("done", None))
        self.assertEqual(
            outcomes["not-a-photo"], ("failed", "PermanentError: not-a-photo is not a photo id")
        )
        testing.assert_submitted(connection, "IMG_2", state="done")

    def test_a_failed_attempt_is_retried(self) -> None:
        calls: list[str] = []

        def flaky(photo_id: str) -> None:
            calls.append(photo_id)
            if len(calls) == 1:
                raise TimeoutError("storage busy")

        reactor.submit(connection, "IMG_3")
        [first] = testing.run_jobs(connection, handlers={"photo.process": flaky})
        self.assertEqual((first.outcome, first.error), ("retry", "TimeoutError: storage busy"))
        self.assertEqual(testing.run_jobs(connection, handlers={"photo.process": flaky}), [])
        testing.advance(connection, 3600)  # as if an hour had passed: the retry is due
        [second] = testing.run_jobs(connection, handlers={"photo.process": flaky})
        self.assertEqual((second.outcome, second.attempt), ("done", 2))
