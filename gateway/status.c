/* status.c - the admin listener's status page for a person (SPEC 10): one HTML page, no framework, that refreshes
 * itself from /status.json (counts only: never keys, scopes or bodies; a route's errors are the server-side outcomes
 * only, SPEC 11). It never changes anything. */
#include "gateway/status.h"

#include <string.h>

/* clang-format off */
static const char page[] =
"<!doctype html>\n"
"<html lang=\"en\"><head><meta charset=\"utf-8\">\n"
"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
"<title>idemgate status</title>\n"
"<style>\n"
"body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d2330;background:#f6f7f9}\n"
"h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:24px 0 8px}\n"
".sub{color:#667;margin-bottom:16px}\n"
"table{border-collapse:collapse;background:#fff;box-shadow:0 1px 2px #0002;min-width:60%}\n"
"th,td{padding:6px 12px;border-bottom:1px solid #e6e8ec;text-align:right;white-space:nowrap}\n"
"th:first-child,td:first-child{text-align:left}th{background:#eef0f4;font-weight:600}\n"
".up{color:#11743b;font-weight:600}.down{color:#b3261e;font-weight:600}.disabled{color:#888}\n"
".cards{display:flex;gap:12px;flex-wrap:wrap}.card{background:#fff;padding:10px 16px;box-shadow:0 1px 2px #0002;min-width:150px}\n"
".card b{display:block;font-size:18px}.bad{color:#b3261e}\n"
"</style></head><body>\n"
"<h1>idemgate</h1><div class=\"sub\">refreshes every second &middot; <span id=\"updated\">loading&hellip;</span></div>\n"
"<div class=\"cards\">\n"
"<div class=\"card\">Postgres<b id=\"pg\" class=\"disabled\">&ndash;</b></div>\n"
"<div class=\"card\">Redis<b id=\"redis\" class=\"disabled\">&ndash;</b></div>\n"
"<div class=\"card\">Upstream p50 (5 min)<b id=\"p50\">&ndash;</b></div>\n"
"<div class=\"card\">Upstream p99 (5 min)<b id=\"p99\">&ndash;</b></div>\n"
"<div class=\"card\">Upstream requests (5 min)<b id=\"upcount\">&ndash;</b></div>\n"
"<div class=\"card\">Client connections<b id=\"conns\">&ndash;</b></div>\n"
"</div>\n"
"<h2>Routes</h2>\n"
"<table id=\"routes\"><thead><tr><th>route</th><th>requests</th><th>rate /s</th><th>forwarded</th><th>replays</th>"
"<th>in-flight conflicts</th><th>key mismatches</th><th>errors</th><th>stuck</th></tr></thead><tbody></tbody></table>\n"
"<script>\n"
"'use strict';\n"
"const prev = {};\n"
"function cell(tr, cls, v){const td=document.createElement('td');td.className=cls;td.textContent=v;tr.appendChild(td);return td;}\n"
"function ms(s){return s>0?(s*1000).toFixed(s<0.01?2:1)+' ms':'\\u2013';}\n"
"function state(id, v){const e=document.getElementById(id);e.textContent=v;e.className=v;}\n"
"function render(st, now){\n"
"  state('pg', st.store.postgres); state('redis', st.store.redis);\n"
"  document.getElementById('p50').textContent=ms(st.upstream.p50_seconds);\n"
"  document.getElementById('p99').textContent=ms(st.upstream.p99_seconds);\n"
"  document.getElementById('upcount').textContent=st.upstream.count;\n"
"  document.getElementById('conns').textContent=st.connections;\n"
"  const tb=document.querySelector('#routes tbody'); tb.textContent='';\n"
"  for (const r of st.routes){\n"
"    const tr=document.createElement('tr'); tr.dataset.route=r.name;\n"
"    cell(tr,'name',r.name); cell(tr,'requests',r.requests);\n"
"    const p=prev[r.name]; let rate=0;\n"
"    if (p && now>p.t) rate=Math.max(0,(r.requests-p.n)*1000/(now-p.t));\n"
"    prev[r.name]={n:r.requests,t:now};\n"
"    cell(tr,'rate',rate.toFixed(1)); cell(tr,'forwarded',r.outcomes.forwarded); cell(tr,'replays',r.replays);\n"
"    cell(tr,'in_flight',r.in_flight_conflicts); cell(tr,'mismatches',r.parameter_conflicts);\n"
"    const ec=cell(tr,'errors',r.errors); if (r.errors) ec.classList.add('bad');\n"
"    const sc=cell(tr,'stuck',r.stuck); if (r.stuck) sc.classList.add('bad');\n"
"    tb.appendChild(tr);\n"
"  }\n"
"  document.getElementById('updated').textContent='updated '+new Date().toLocaleTimeString();\n"
"}\n"
"async function tick(){\n"
"  try { const r=await fetch('status.json',{cache:'no-store'}); if (r.ok) render(await r.json(), Date.now()); }\n"
"  catch (e) { document.getElementById('updated').textContent='gateway unreachable'; }\n"
"  setTimeout(tick, 1000);\n"
"}\n"
"tick();\n"
"</script></body></html>\n";
/* clang-format on */

const char *gw_status_page(size_t *len)
{
    *len = sizeof page - 1;
    return page;
}
