"""What the mixin's alerts page on and how hard, declared once from the cause
catalogue (kvwatch/diagnose/causes.py) and the objectives
(kvwatch/mixin/objectives.py): each alert's symptom (ALERTS), each cause's
default severity (DEFAULT_SEVERITIES) and each alert's default `for:`
(DEFAULT_FOR). The mixin config (config.py) overrides the last two and
re-exports all of them."""

from __future__ import annotations

from kvwatch.diagnose.causes import ALERT_LIST, CAUSE_LIST
from kvwatch.mixin.objectives import OBJECTIVE_ALERTS

# Alert names, with the symptom (the diagnosis vocabulary) each one reports:
# the cause catalogue's alerts (kvwatch/diagnose/causes.py) and the
# objectives' burn-rate alerts (kvwatch/mixin/objectives.py): what pages.
ALERTS = {
    **{alert.name: alert.symptom for alert in ALERT_LIST},
    **{alert: symptom for alert, symptom, _ in OBJECTIVE_ALERTS.values()},
}
# The causes the rules tell apart, per alert. The diagnosis' third exhaustion
# cause (capacity_below_max_num_seqs) needs --max-num-seqs, which vLLM does
# not export, so Prometheus cannot decide it; the health alerts have one cause
# each. `upstream` and `no_reuse` are generated only when the config asks.

# Each cause's severity from its record (the diagnosis' own, and the alerts'
# own health causes): the page, kvwatch_finding and the alert say the same.
# An exhaustion cause has two rules: with preemptions in the rate window
# (`<cause>_preempting`, the record's preempting_severity, the page's
# critical line: severity_of(cause, preempting=True)) and without (its severity).
PREEMPTING_SUFFIX = "_preempting"
DEFAULT_SEVERITIES = {
    **{c.name: c.severity for c in CAUSE_LIST if c.alert and c.diagnosed},
    **{c.name + PREEMPTING_SUFFIX: c.preempting_severity for c in CAUSE_LIST
       if c.alert and c.preempting_severity},
    **{c.name: c.severity for c in CAUSE_LIST if c.alert and not c.diagnosed},
}

DEFAULT_FOR = {
    **{alert.name: alert.for_ for alert in ALERT_LIST},
    # The short window already proves the burn is current; 2m more keeps one
    # evaluation at a window's edge from paging.
    **{alert: "2m" for alert, _, _ in OBJECTIVE_ALERTS.values()},
}
