"""What every rank does at a step boundary: the action rank 0 puts in the step header."""

import enum
from dataclasses import dataclass


class Action(enum.IntEnum):
    """What every rank does at a step boundary (sent in the step header)."""

    NONE = 0
    BEGIN_STAGED = 1  # start receiving into staging in the background (payload: the request)
    POLL = 2  # all-reduce "staged receive done / ok"; gather verdicts when all done
    COMMIT = 3  # swap staged weights in
    LOAD = 4  # receive into the live weights now (payload: the request)
    RELEASE = 5  # free memory (tags mask)
    RESUME = 6  # re-allocate memory (tags mask)
    ABORT = 7  # discard a staged receive that outlived its timeout
    TRANSPORT_SETUP = 8  # start a transport's rank set-up or tear-down (payload: the request)
    ROLLBACK = 9  # swap the previous version, held in staging, back in
    SETUP_POLL = 10  # all-reduce "transport set-up done"; gather the outcomes when all done
    PLACE_EXPERTS = 11  # move the experts to a new expert map now (payload: the request)


TAG_BITS = {"kv_cache": 1, "weights": 2}


def tags_to_mask(tags: list[str]) -> int:
    return sum(TAG_BITS[tag] for tag in set(tags))


def mask_to_tags(mask: int) -> list[str]:
    return [tag for tag, bit in TAG_BITS.items() if mask & bit]


@dataclass(slots=True)
class StepAction:
    action: Action = Action.NONE
    payload: bytes = b""
    tags_mask: int = 0
