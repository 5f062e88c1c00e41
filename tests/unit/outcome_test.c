/* outcome_test.c - the pipeline's outcome table (upstream result -> answer, record action, effect) walked against
 * SPEC 1, 4, 7 and 8, and its life cycle's transitions. */
#include <criterion/criterion.h>
#include <string.h>

#include "gateway/pipeline.h"

/* What the SPEC says, written down apart from the table: every case the pipeline can meet. */
struct expect {
    bool idempotent;
    bool started;
    enum up_result result;
    bool release_status;
    int status;          /* 0: the upstream's own answer */
    const char *problem; /* SPEC 4/7 problem name */
    enum gw_record_action record;
    enum gw_effect effect;
    const char *outcome; /* SPEC 11's label of idemgate_requests_total */
};

#define P false
#define I true
static const struct expect spec[] = {
    /* SPEC 4: first request: the upstream's answer, as is; record completed */
    {I, true, UP_OK, false, 0, NULL, GW_RECORD_COMPLETE, GW_EFFECT_APPLIED, "forwarded"},
    /* SPEC 4: a release_statuses answer: that answer, key released (SPEC 6: applied unchanged); SPEC 11: the
     * upstream answered it, so it counts as forwarded */
    {I, true, UP_OK, true, 0, NULL, GW_RECORD_RELEASE, GW_EFFECT_NONE, "forwarded"},
    /* SPEC 4: upstream unreachable, nothing sent: 502 upstream-unavailable, key released */
    {I, true, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", GW_RECORD_RELEASE, GW_EFFECT_NONE,
     "upstream_error"},
    {I, false, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", GW_RECORD_RELEASE, GW_EFFECT_NONE,
     "upstream_error"},
    /* SPEC 1/4: timeout after sending: 504, record kept as an unknown outcome, never released */
    {I, true, UP_TIMEOUT, false, 504, "upstream-timeout", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN, "unknown"},
    /* SPEC 4: closed or reset after sending: 502 upstream-no-response, unknown outcome */
    {I, true, UP_NO_RESPONSE, false, 502, "upstream-no-response", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN, "unknown"},
    {I, true, UP_ERROR, false, 502, "upstream-no-response", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN, "unknown"},
    {I, true, UP_CANCELLED, false, 502, "upstream-no-response", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN, "unknown"},
    /* SPEC 7: an answer the gateway will not pass on: 502 upstream-invalid-response, unknown outcome */
    {I, true, UP_INVALID_RESPONSE, false, 502, "upstream-invalid-response", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN,
     "unknown"},
    /* SPEC 7 (every answer stored can be given back): executed, answer over max_response: unknown outcome */
    {I, true, UP_TOO_LARGE, false, 502, "upstream-response-too-large", GW_RECORD_MARK_UNKNOWN, GW_EFFECT_UNKNOWN,
     "unknown"},

    /* passthrough: the same answers, no record; SPEC 11: a failure is upstream_error, since no record is left as an
     * unknown outcome to settle */
    {P, true, UP_OK, false, 0, NULL, GW_RECORD_NONE, GW_EFFECT_APPLIED, "passthrough"},
    {P, true, UP_OK, true, 0, NULL, GW_RECORD_NONE, GW_EFFECT_NONE, "passthrough"},
    {P, true, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", GW_RECORD_NONE, GW_EFFECT_NONE, "upstream_error"},
    {P, false, UP_CONNECT_FAILED, false, 502, "upstream-unavailable", GW_RECORD_NONE, GW_EFFECT_NONE, "upstream_error"},
    {P, true, UP_TIMEOUT, false, 504, "upstream-timeout", GW_RECORD_NONE, GW_EFFECT_UNKNOWN, "upstream_error"},
    {P, true, UP_NO_RESPONSE, false, 502, "upstream-no-response", GW_RECORD_NONE, GW_EFFECT_UNKNOWN, "upstream_error"},
    {P, true, UP_ERROR, false, 502, "upstream-no-response", GW_RECORD_NONE, GW_EFFECT_UNKNOWN, "upstream_error"},
    {P, true, UP_CANCELLED, false, 502, "upstream-no-response", GW_RECORD_NONE, GW_EFFECT_UNKNOWN, "upstream_error"},
    {P, true, UP_INVALID_RESPONSE, false, 502, "upstream-invalid-response", GW_RECORD_NONE, GW_EFFECT_UNKNOWN,
     "upstream_error"},
    {P, true, UP_TOO_LARGE, false, 502, "upstream-response-too-large", GW_RECORD_NONE, GW_EFFECT_UNKNOWN,
     "upstream_error"},
    /* SPEC 8: the lease ended before the request could leave: nothing sent, released fenced by its token */
    {P, true, UP_LEASE_LOST, false, 503, "store-unavailable", GW_RECORD_NONE, GW_EFFECT_NONE, "store_unavailable"},
    {I, true, UP_LEASE_LOST, false, 503, "store-unavailable", GW_RECORD_RELEASE, GW_EFFECT_NONE, "store_unavailable"},
};
#define SPEC_N (sizeof spec / sizeof spec[0])

static bool same_case(const struct gw_outcome *o, const struct expect *e)
{
    if (o->idempotent != e->idempotent || o->started != e->started)
        return false;
    if (!e->started)
        return true;
    return o->result == e->result && (e->result != UP_OK || o->release_status == e->release_status);
}

Test(outcome, every_spec_case_has_its_answer)
{
    for (size_t i = 0; i < SPEC_N; i++) {
        const struct expect *e = &spec[i];
        const struct gw_outcome *o = gw_outcome_for(e->idempotent, e->started, e->result, e->release_status);
        cr_assert_not_null(o, "case %zu", i);
        cr_expect(same_case(o, e), "case %zu (%s %s): got the row of another case", i, up_result_name(e->result),
                  e->idempotent ? "idempotent" : "passthrough");
        cr_expect_eq(o->status, e->status, "case %zu (%s): status %d", i, up_result_name(e->result), o->status);
        if (e->problem)
            cr_expect(o->problem && strcmp(o->problem, e->problem) == 0, "case %zu: problem %s", i,
                      o->problem ? o->problem : "(none)");
        else
            cr_expect_null(o->problem, "case %zu: the upstream's answer carries no problem", i);
        cr_expect_eq(o->record, e->record, "case %zu (%s): record action %d", i, up_result_name(e->result), o->record);
        cr_expect_eq(o->effect, e->effect, "case %zu (%s): effect %d", i, up_result_name(e->result), o->effect);
        cr_expect_str_eq(cm_outcome_name(o->outcome), e->outcome, "case %zu (%s %s): outcome %s, SPEC 11 says %s", i,
                         up_result_name(e->result), e->idempotent ? "idempotent" : "passthrough",
                         cm_outcome_name(o->outcome), e->outcome);
    }
}

Test(outcome, every_row_is_a_spec_case)
{
    size_t n = 0;
    const struct gw_outcome *t = gw_outcome_table(&n);
    cr_assert_eq(n, SPEC_N, "the table has %zu rows, the SPEC %zu cases", n, SPEC_N);
    for (size_t i = 0; i < n; i++) {
        size_t hits = 0;
        for (size_t j = 0; j < SPEC_N; j++)
            hits += same_case(&t[i], &spec[j]);
        cr_expect_eq(hits, 1, "row %zu (%s) matches %zu SPEC cases", i, up_result_name(t[i].result), hits);
        /* a row is found by its own case */
        cr_expect_eq(gw_outcome_for(t[i].idempotent, t[i].started, t[i].result, t[i].release_status), &t[i],
                     "row %zu is not what gw_outcome_for answers for its case", i);
    }
}

Test(outcome, rows_are_consistent)
{
    size_t n = 0;
    const struct gw_outcome *t = gw_outcome_table(&n);
    for (size_t i = 0; i < n; i++) {
        const struct gw_outcome *o = &t[i];
        /* a problem answer has a name, a title and a detail; the upstream's answer has none */
        cr_expect_eq(o->status == 0, o->problem == NULL, "row %zu", i);
        if (o->status) {
            cr_expect(o->status >= 500 && o->status <= 504, "row %zu: status %d", i, o->status);
            cr_expect(o->title && o->title[0] && o->detail && o->detail[0], "row %zu", i);
        }
        if (!o->idempotent) {
            cr_expect_eq(o->record, GW_RECORD_NONE, "row %zu: passthrough has no record", i);
            continue;
        }
        /* SPEC 1: what may have executed is never released; what did not run always is */
        switch (o->effect) {
        case GW_EFFECT_NONE:
            cr_expect_eq(o->record, GW_RECORD_RELEASE, "row %zu", i);
            break;
        case GW_EFFECT_APPLIED:
            cr_expect_eq(o->record, GW_RECORD_COMPLETE, "row %zu", i);
            break;
        case GW_EFFECT_UNKNOWN:
            cr_expect_eq(o->record, GW_RECORD_MARK_UNKNOWN, "row %zu", i);
            break;
        }
        if (!o->started)
            cr_expect_eq(o->effect, GW_EFFECT_NONE, "row %zu: nothing sent, nothing executed", i);
        if (o->status == 504)
            cr_expect_neq(o->record, GW_RECORD_RELEASE, "row %zu: a timeout after sending is unknown", i);
        /* SPEC 11: unknown is exactly what leaves a record to settle */
        cr_expect_eq(strcmp(cm_outcome_name(o->outcome), "unknown") == 0, o->record == GW_RECORD_MARK_UNKNOWN,
                     "row %zu: outcome %s, record action %d", i, cm_outcome_name(o->outcome), o->record);
    }
}

/* SPEC 11: idemgate_requests_total's outcome label takes exactly these values (and the access line's outcome, the
 * span's idemgate.outcome: all print cm_outcome_name). */
Test(outcome, labels_are_exactly_spec_11s)
{
    static const char *const want[] = {"forwarded", "replayed",          "mismatch",       "in_flight",  "rejected",
                                       "unknown",   "store_unavailable", "upstream_error", "overloaded", "passthrough"};
    size_t n = sizeof want / sizeof want[0];
    cr_expect_eq((size_t)CM_OUT__COUNT, n, "%d outcome labels, SPEC 11 names %zu", (int)CM_OUT__COUNT, n);
    for (size_t i = 0; i < n; i++) {
        bool found = false;
        for (int o = 0; o < CM_OUT__COUNT; o++)
            found = found || strcmp(cm_outcome_name((enum cm_outcome)o), want[i]) == 0;
        cr_expect(found, "SPEC 11's outcome %s has no label", want[i]);
    }
    for (int o = 0; o < CM_OUT__COUNT; o++) {
        bool found = false;
        for (size_t i = 0; i < n; i++)
            found = found || strcmp(cm_outcome_name((enum cm_outcome)o), want[i]) == 0;
        cr_expect(found, "outcome label %s is not one of SPEC 11's", cm_outcome_name((enum cm_outcome)o));
    }
}

Test(outcome, an_unnamed_result_is_an_unknown_outcome)
{
    const struct gw_outcome *o = gw_outcome_for(true, true, (enum up_result)99, false);
    cr_assert_not_null(o);
    cr_expect_eq(o->record, GW_RECORD_MARK_UNKNOWN);
    cr_expect_eq(o->status, 502);
    o = gw_outcome_for(false, true, (enum up_result)99, false);
    cr_assert_not_null(o);
    cr_expect_eq(o->effect, GW_EFFECT_UNKNOWN);
    /* release_status only means something with an answer */
    cr_expect_eq(gw_outcome_for(true, true, UP_TIMEOUT, true)->record, GW_RECORD_MARK_UNKNOWN);
}

/* The states reachable from a (a excluded unless a cycle leads back to it). */
static unsigned reachable(enum gw_pipe_state a)
{
    unsigned seen = 0, frontier = 1u << a;
    while (frontier) {
        unsigned next = 0;
        for (int s = 0; s < GW_PIPE__COUNT; s++) {
            if (!(frontier & (1u << s)))
                continue;
            for (int b = 0; b < GW_PIPE__COUNT; b++)
                if (gw_pipe_transition_ok((enum gw_pipe_state)s, (enum gw_pipe_state)b) && !(seen & (1u << b)))
                    next |= 1u << b;
        }
        seen |= next;
        frontier = next;
    }
    return seen;
}

Test(pipe_state, every_state_is_reached_and_ends)
{
    unsigned from_new = reachable(GW_PIPE_NEW);
    for (int s = 0; s < GW_PIPE__COUNT; s++) {
        cr_expect_str_neq(gw_pipe_state_name((enum gw_pipe_state)s), "invalid");
        if (s != GW_PIPE_NEW)
            cr_expect(from_new & (1u << s), "%s is never reached", gw_pipe_state_name((enum gw_pipe_state)s));
        if (s != GW_PIPE_DONE)
            cr_expect(reachable((enum gw_pipe_state)s) & (1u << GW_PIPE_DONE), "%s never ends",
                      gw_pipe_state_name((enum gw_pipe_state)s));
    }
    cr_expect_eq(reachable(GW_PIPE_DONE), 0u, "done is final");
    cr_expect_str_eq(gw_pipe_state_name(GW_PIPE__COUNT), "invalid");
    cr_expect(!gw_pipe_transition_ok(GW_PIPE__COUNT, GW_PIPE_DONE));
}

Test(pipe_state, forwarded_at_most_once)
{
    /* SPEC 1: once the transfer started, no path leads to another transfer or another claim */
    unsigned after = reachable(GW_PIPE_FORWARDING);
    cr_expect(!(after & (1u << GW_PIPE_FORWARDING)));
    cr_expect(!(after & (1u << GW_PIPE_CLAIMING)));
    cr_expect(!(after & (1u << GW_PIPE_GUARDING)));
    /* a settled record is not claimed again */
    cr_expect(!(reachable(GW_PIPE_RECORDING) & (1u << GW_PIPE_CLAIMING)));
    /* answered once */
    cr_expect(!gw_pipe_transition_ok(GW_PIPE_DONE, GW_PIPE_DONE));
}
