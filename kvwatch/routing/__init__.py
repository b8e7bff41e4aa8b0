"""Routing attribution: a router's metrics page read beside the engines',
each window's prefix reuse per model split into what the router predicted,
what the engines delivered and, where the router says it, what the best
replica held; and the causes of a low hit rate that lie in the router.

- page: the router's page in each router's names (llm-d's endpoint picker,
  current and deprecated; NVIDIA Dynamo's KV router; SGLang's router) read
  into one cumulative RouterReading;
- attribution: two readings and the engines' counters over a window give a
  RoutingWindow; judge_routing turns it into findings.
"""

from kvwatch.routing.attribution import RoutingWindow, attribute, judge_routing
from kvwatch.routing.page import DIALECTS, RouterReading, read_router_page

__all__ = ["DIALECTS", "RouterReading", "RoutingWindow", "attribute", "judge_routing", "read_router_page"]
