"""Watching an ASGI `receive` for the client's going away, without a Task (the routes while a request is queued or
computed, the admission middleware while it waits for a slot)."""

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine

from starlette.types import Message, Receive


class DisconnectWatch:
    """Calls `on_disconnect` once when `receive` answers http.disconnect (or fails), until `close()`.

    This drives the `receive()` coroutine itself, as a Task would: each step runs it to its next await and resumes it
    from the awaited future's done callback. A Task per request for this (created, first step, cancelled, its
    unwinding step and its done callback) cost ~15-25 µs of event-loop CPU per request, about a fifth of the loop's
    whole work for a short text; this costs one step and a callback.

    Once the body is read (the routes), the next ASGI message is http.disconnect: the client went away (or the response
    was sent, by which time the watch is closed); anything else is skipped. With `keep` (a request waiting for an
    admission slot, its body not yet read) the messages before the disconnect are kept there for the app, up to
    `max_body_bytes` of body; past that the watch stops, and the app answers 413 once admitted."""

    def __init__(self, receive: Receive, on_disconnect: Callable[[], object], keep: deque[Message] | None = None,
                 max_body_bytes: int = 0):  # fmt: skip
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._keep, self._body_left = keep, max_body_bytes
        self._coroutine: Coroutine | None = None
        self._awaited: asyncio.Future | None = None
        self.fired = self._closed = False
        self._step()

    def _step(self, _awaited: object = None) -> None:
        self._awaited = None
        if self._closed:  # a step scheduled before close()
            return
        if self._coroutine is None:
            self._coroutine = self._receive()
        try:
            awaited = self._coroutine.send(None)
        except StopIteration as end:
            self._coroutine = None
            message = end.value
            if message["type"] == "http.disconnect":
                self._fire()
                return
            if self._keep is not None:
                self._keep.append(message)
                self._body_left -= len(message.get("body", b""))
                if self._body_left < 0:
                    return
            # (without `keep`: more body than announced, or a server that sends something else) keep listening
            asyncio.get_running_loop().call_soon(self._step)
            return
        except asyncio.CancelledError:  # the server cancelled the receive: not a disconnect
            self._coroutine = None
            return
        except Exception:  # a failing receive ends the request as the client's going away does
            self._coroutine = None
            self._fire()
            return
        if awaited is None:  # a bare yield (asyncio.sleep(0)): run again on the next loop pass
            asyncio.get_running_loop().call_soon(self._step)
        else:  # an asyncio future: resume when it is done, as a Task does
            awaited._asyncio_future_blocking = False
            self._awaited = awaited
            awaited.add_done_callback(self._step)

    def _fire(self) -> None:
        self.fired = True
        self._on_disconnect()

    def close(self) -> None:
        """Stop watching: the awaited future forgets the callback and the receive coroutine is closed (what uvicorn's
        receive has not returned stays buffered for the next call)."""
        self._closed = True
        if self._awaited is not None:
            self._awaited.remove_done_callback(self._step)
            self._awaited = None
        if self._coroutine is not None:
            self._coroutine.close()
            self._coroutine = None
