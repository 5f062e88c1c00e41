/* status.h - the admin status page (GET / on the admin listener). Static text; it never reads or changes state. */
#ifndef IDEMGATE_GW_STATUS_H
#define IDEMGATE_GW_STATUS_H

#include <stddef.h>

/* The page's HTML (static, never freed); *len gets its length. It fetches status.json next to itself. */
const char *gw_status_page(size_t *len);

#endif
