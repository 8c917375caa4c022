"""liverl's client for products: publish a user's judgement of a generation (``FeedbackClient``), with the wire
contract it is checked against (``liverl_sdk.wire``); ask liverl to forget a user (``ErasureClient``, HTTP, stdlib
only). It installs without the server's dependencies.

    from liverl_sdk import FeedbackClient

    with FeedbackClient("127.0.0.1:9092", "liverl.feedback") as fb:
        fb.accept(generation_id)
"""

from liverl_sdk.client import DeliveryError, FeedbackClient
from liverl_sdk.edits import EDIT_KEY_HEADER, EditSealError, open_edit, seal_edit
from liverl_sdk.erasures import ErasureClient, ErasureError
from liverl_sdk.wire import FeedbackEvent, WireError

__all__ = [
    "EDIT_KEY_HEADER",
    "DeliveryError",
    "EditSealError",
    "ErasureClient",
    "ErasureError",
    "FeedbackClient",
    "FeedbackEvent",
    "WireError",
    "open_edit",
    "seal_edit",
]
