"""The offline round walk: held-out drafts met one round after another, as a greedy run
meets them."""

from scripts.eagle_eval import _walk


def test_each_round_starts_after_the_previous_bonus_token():
    # start 0 accepts 2 -> next round at 3 accepts 0 -> next at 4 accepts 1 -> next at 6
    assert _walk([2, 5, 5, 0, 1, 5, 3]) == [3, 1, 2, 4]


def test_rounds_skip_the_easy_starts_that_a_per_position_mean_counts():
    accepted = [4, 4, 4, 4, 4, 0, 0, 0, 0, 0]
    rounds = _walk(accepted)
    assert rounds == [5, 1, 1, 1, 1, 1]
    assert sum(rounds) / len(rounds) < 1 + sum(accepted) / len(accepted)
