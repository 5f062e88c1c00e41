/* gate.h - the upstream kill switch: a byte relay in front of testupstream that a fault can close (refuse new
 * connections, reset the relayed ones) while testupstream keeps its execution counts. */
#ifndef CHAOS_GATE_H
#define CHAOS_GATE_H

#include <stdbool.h>

/* The relay thread (pthread start routine): listens on ch.gate_port while ch.gate_want_up, relays to
 * ch.tu_port, until ch.gate_stop. Returns NULL. */
void *ch_gate_main(void *arg);
/* Opens (up) or closes the gate and waits up to 3 s for it; false when it did not happen. */
bool ch_gate_set(bool up);

#endif
